"""MLflow records (`pipeline.tracking.runs`): credentials never printed."""

from __future__ import annotations


def test_credentials_are_redacted_from_printed_uris() -> None:
    from pipeline.tracking.runs import redact

    assert (
        redact("https://alice:s3cret@mlflow.example:5000/x") == "https://***@mlflow.example:5000/x"
    )
    assert redact("sqlite:////tmp/run/mlflow.db") == "sqlite:////tmp/run/mlflow.db"
