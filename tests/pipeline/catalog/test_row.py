"""A catalog row (`pipeline.catalog.row`): the typed core columns derived from `CatalogRow`'s
fields, a field's Arrow type, a row as the table stores it (figures flattened beside the
core columns), and the time a row is stamped with."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from pipeline.catalog.row import CORE, CORE_SCHEMA, CatalogRow, arrow_type, now


def test_the_core_schema_is_the_rows_fields_in_their_order_without_figures() -> None:
    names = [f.name for f in dataclasses.fields(CatalogRow)]
    assert names[-1] == "figures"
    assert CORE_SCHEMA.names == names[:-1]
    assert set(names) - {"figures"} == CORE
    assert (CORE_SCHEMA.names[0], CORE_SCHEMA.names[-1]) == ("grid_key", "lorp_version")


@pytest.mark.parametrize(
    ("column", "typ"),
    [
        ("grid_key", pa.string()),
        ("budget", pa.int64()),
        ("n_blocks", pa.int64()),
        ("pruned_layers", pa.list_(pa.int64())),
        ("sublayers", pa.list_(pa.string())),
        ("reference_claim", pa.bool_()),
        ("degraded", pa.bool_()),
        ("repair_held_loss_ratio", pa.float64()),
        ("rls", pa.float64()),
        ("lorp_version", pa.string()),
    ],
)
def test_each_core_column_has_its_fields_arrow_type(column: str, typ: pa.DataType) -> None:
    field = CORE_SCHEMA.field(column)
    assert field.type == typ and field.nullable


def test_arrow_type_reads_optional_and_list_annotations() -> None:
    assert arrow_type(int) == pa.int64()
    assert arrow_type(str | None) == pa.string()
    assert arrow_type(bool | None) == pa.bool_()
    assert arrow_type(list[int] | None) == pa.list_(pa.int64())
    assert arrow_type(list[str]) == pa.list_(pa.string())
    with pytest.raises(KeyError):  # no column type for a mapping: figures are not core
        arrow_type(dict)


def test_a_record_is_every_core_column_then_each_figure_as_a_column() -> None:
    row = CatalogRow(
        grid_key="k1",
        budget=2,
        pruned_layers=[3, 4],
        reference_claim=True,
        figures={"ppl_ptb": 21.5, "speedup": None},
    )
    record = row.record()
    assert list(record) == [*CORE_SCHEMA.names, "ppl_ptb", "speedup"]
    assert "figures" not in record
    assert record["grid_key"] == "k1" and record["budget"] == 2
    assert record["pruned_layers"] == [3, 4] and record["reference_claim"] is True
    assert record["ppl_ptb"] == 21.5 and record["speedup"] is None
    assert record["model"] is None and record["kept_layers"] is None  # unset: null


def test_a_figure_named_like_a_core_column_is_refused() -> None:
    row = CatalogRow(grid_key="k2", budget=2, figures={"budget": 3.0, "rls": 0.5, "ppl": 1.0})
    with pytest.raises(
        ValueError, match=r"^catalog row 'k2': figures \['budget', 'rls'\] are core columns$"
    ):
        row.record()


def test_now_is_utc_iso_8601_to_the_millisecond() -> None:
    stamp = now()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", stamp), stamp
    when = datetime.fromisoformat(stamp)
    assert when.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - when) < timedelta(seconds=5)
