"""Static fleet dashboards: the catalog and the cached statistics as browsable pages."""

from dashboards.site import build_site

__all__ = ["build_site"]
