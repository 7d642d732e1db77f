"""Domains: the kinds of text a model serves (prose, code, or the user's own), and which
domain each corpus of a job is text of.

Packaged corpora know their domain (`lorp.data.corpora.ALIAS_DOMAINS`: ptb, lee and wiki are
prose, code is code; the hub's c4 and wikitext are prose). A job tags any other corpus in
its top-level `domains:` mapping (corpus -> domain); a corpus it does not tag is a domain of
its own, named after the corpus, so two unrelated corpora are never pooled by accident.

What domains drive (docs: Domains): the repair's held-out windows are drawn from every
calibration domain and a map is kept only where no domain's held-out error grows; a
repaired variant whose held-out loss is worse than its unrepaired twin's on any domain
falls back; and the quality gate, `best-<b>` and the registry's ranking judge a variant by
its worst domain, or by `evaluation.rank_domain` where the job names one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from lorp.data.corpora import ALIAS_DOMAINS
from pipeline.spec.checks import SpecError

HUB_DOMAINS = {"c4": "prose", "allenai/c4": "prose", "wikitext2": "prose", "wikitext": "prose"}
"""The hub corpora a job names by short name (`pipeline.evaluation.corpora.HUB_CORPORA`)."""
DOMAIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_domains(domains: Mapping[str, object]) -> None:
    """SpecError naming the entry unless every key is a corpus and every value a domain
    name (lower-case letters, digits, '-' and '_', at most 32)."""
    for corpus, domain in domains.items():
        if not isinstance(corpus, str) or not corpus.strip():
            raise SpecError(f"domains: a corpus name must be a non-empty string, got {corpus!r}")
        if not isinstance(domain, str) or not DOMAIN_NAME.match(domain):
            raise SpecError(
                f"domains.{corpus}: a domain is lower-case letters, digits, '-' and '_' "
                f"(at most 32), got {domain!r}"
            )
        known = ALIAS_DOMAINS.get(corpus) or HUB_DOMAINS.get(corpus)
        if known is not None and known != domain:
            raise SpecError(
                f"domains.{corpus}: {corpus!r} is packaged {known} text, got {domain!r}"
            )


def domain_of(corpus: str, domains: Mapping[str, str]) -> str:
    """The domain of `corpus`: the job's tag, the packaged one, or the corpus's own name."""
    if corpus in domains:
        return domains[corpus]
    known = ALIAS_DOMAINS.get(corpus) or HUB_DOMAINS.get(corpus)
    if known is not None:
        return known
    own = re.sub(r"[^a-z0-9_-]+", "-", Path(corpus).stem.lower()).strip("-_")
    return own[:32] or "custom"


def domains_of(corpora: Iterable[str], domains: Mapping[str, str]) -> dict[str, list[str]]:
    """Domain -> its corpora among `corpora`, in the order first met."""
    out: dict[str, list[str]] = {}
    for corpus in corpora:
        out.setdefault(domain_of(corpus, domains), []).append(corpus)
    return out


def uncovered(
    calibrated: Mapping[str, Iterable[str]], judged: Iterable[str], domains: Mapping[str, str]
) -> list[str]:
    """One warning line for each model (`calibrated`: model label -> its calibration
    corpora) judged on a domain none of its calibration corpora is text of: its repair is
    validated without that domain, and its selection never saw it."""
    wanted = domains_of(judged, domains)
    out = []
    for label, corpora in calibrated.items():
        have = domains_of(corpora, domains)
        missing = [d for d in wanted if d not in have]
        if missing:
            out.append(
                f"{label}: judged on {', '.join(missing)} text but calibrated on "
                f"{', '.join(have)} only; add a {missing[0]} corpus to its calibration "
                "(calibration.dataset, or models[].calibration)"
            )
    return out
