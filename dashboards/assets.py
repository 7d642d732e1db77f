"""The site's inline style and script: every page carries them, nothing is fetched."""

from __future__ import annotations

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222;
padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4;cursor:pointer}
td.l,th.l{text-align:left}tr.dense td{font-style:italic;background:#fafafa}
tr.degraded td{background:#fbeaec}
.badge{display:inline-block;margin-left:6px;padding:0 5px;border-radius:3px;font-size:11px;
font-style:normal;color:#fff;background:#777}
.badge.degraded{background:#b3263a}.badge.fits-calibration{background:#7a4fa0}.badge.over-bound{background:#c46a00}
.mark{color:#b3263a;font-weight:bold}.mark.unknown{color:#777}
td.over-bound{color:#c46a00;font-weight:bold}
figure{display:inline-block;margin:8px 16px 8px 0;vertical-align:top;max-width:560px}
figcaption{font-size:12px;color:#555;margin-top:4px}
.maps td{text-align:left}.filters{margin:8px 0}.filters label{margin-right:12px}
.muted{color:#777}a{color:#1b6ca8}code{font-size:12px}
nav.pages{margin:4px 0 12px}table.headline td{border:none;padding:1px 12px 1px 0}
figure.wide,svg.gantt{max-width:none}svg.gantt text{font-family:system-ui,sans-serif}
ul.legend{list-style:none;padding:0;margin:6px 0}ul.legend li{display:inline-block;
margin-right:14px;font-size:12px}.swatch{display:inline-block;width:12px;height:10px;
margin-right:4px;vertical-align:middle;border:1px solid transparent}
.swatch.failed{border:2px solid;background:repeating-linear-gradient(45deg,#fff 0 2px,
#b3263a 2px 3px)}
"""

# Sorting (click a header; a cell's data-v is its sort key) and filtering (selects over
# data-* attributes of the overview rows).
SCRIPT = """
document.querySelectorAll('table.sortable th').forEach(th => {
  th.addEventListener('click', () => {
    const col = th.cellIndex;
    const body = th.closest('table').tBodies[0];
    const rows = Array.from(body.rows);
    const asc = th.dataset.dir !== 'asc';
    th.dataset.dir = asc ? 'asc' : 'desc';
    const key = r => { const t = r.cells[col].dataset.v ?? r.cells[col].textContent;
                       const n = parseFloat(t); return isNaN(n) ? t : n; };
    rows.sort((a, b) => (key(a) > key(b) ? 1 : key(a) < key(b) ? -1 : 0) * (asc ? 1 : -1));
    rows.forEach(r => body.appendChild(r));
  });
});
function applyFilters() {
  const sel = {};
  const selects = document.querySelectorAll('select[data-filter]');
  selects.forEach(s => { sel[s.dataset.filter] = s.value; });
  document.querySelectorAll('tr[data-row]').forEach(tr => {
    const show = Object.entries(sel).every(
      ([k, v]) => v === '' || (tr.dataset[k] || '').split(' ').includes(v));
    tr.style.display = show ? '' : 'none';
  });
}
document.querySelectorAll('select[data-filter]').forEach(
  s => s.addEventListener('change', applyFilters));
"""
