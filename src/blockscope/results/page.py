"""One self-contained HTML page per run, beside its CSV, sidecar and PNG: the headline, the
charts (`results.charts`, plotly), the tables (sortable by a click on a column's name) and
every setting of the sidecar. It loads one shared script, `plotly.min.js`, written once into
the same folder, and nothing else: the page works with the network off.

Why a shared file and not the script inlined: plotly.js is 4.8 MB, and a folder of runs
would hold it once per page; beside the pages it is written once (plotly's own
`include_plotlyjs="directory"` does the same). The page's own code is a few lines of plain
JavaScript: sorting a table, switching the attention view's head, and marking the page
ready (`data-ready` on the body) once every chart is drawn.
"""

from __future__ import annotations

import html
import json
import math
import numbers
import uuid

import pandas as pd

SCRIPT = "plotly.min.js"  # the shared script, beside the pages
MAX_ROWS = 500  # rows of a table on the page; the CSV has every row
STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
.headline{font-size:1.05em;background:#f4f6fa;padding:.6em .8em;border-radius:4px}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border-bottom:1px solid #ddd;padding:.2em .6em;text-align:right}
th{cursor:pointer;background:#f4f4f4;position:sticky;top:0;user-select:none}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.text,th.text{text-align:left}
.settings td{text-align:left;vertical-align:top}.settings pre{margin:0;white-space:pre-wrap}
.note{color:#666;font-size:.85em}.wide{overflow-x:auto}
"""
SORT = """
function sortBy(th){
  const table=th.closest('table'),body=table.tBodies[0],k=th.cellIndex;
  const down=th.getAttribute('aria-sort')==='ascending';
  for(const h of th.parentNode.cells)h.removeAttribute('aria-sort');
  th.setAttribute('aria-sort',down?'descending':'ascending');
  const num=th.dataset.kind==='number';
  const key=r=>{const t=r.cells[k].dataset.value??r.cells[k].textContent;
    if(!num)return t;const v=parseFloat(t);return isNaN(v)?-Infinity:v;};
  const rows=[...body.rows].sort((a,b)=>{const x=key(a),y=key(b);
    const c=num?x-y:String(x).localeCompare(String(y));return down?-c:c;});
  for(const r of rows)body.appendChild(r);
}
for(const th of document.querySelectorAll('table.data th'))
  th.addEventListener('click',()=>sortBy(th));
"""  # a table sorts on a click on a column's name: numbers as numbers, the rest as text
CODE = SORT + """
const figures=JSON.parse(document.getElementById('figures').textContent);
const drawn=figures.map((f,i)=>Plotly.newPlot('chart-'+i,f.data,f.layout,
  {displaylogo:false,responsive:true}));
const heads=document.getElementById('heads');
if(heads){
  const data=JSON.parse(document.getElementById('attention-data').textContent);
  const i=figures.findIndex(f=>f.layout.meta==='attention');
  heads.addEventListener('change',()=>{const [l,h]=heads.value.split('.');
    Plotly.update('chart-'+i,{z:[data[heads.value]]},
      {title:{text:'layer '+l+', head '+h+': where each query attends'}});});
}
Promise.all(drawn).then(()=>{document.body.dataset.ready=String(performance.now());});
"""


def page(result, files: dict[str, str] | None = None) -> str:
    """The page of `result` (a `Result`), `files` naming its other files (label -> file
    name) for links."""
    from blockscope.results.charts import attention_data, charts

    try:
        figures, failed = charts(result), None
    except Exception as exc:  # a chart's bug must not cost the run its files
        figures, failed = [], f"{type(exc).__name__}: {exc}"
    title = f"blockscope {result.command}: {result.stem}"
    parts = [f"<h1>{_e(title)}</h1>"]
    if result.headline:
        parts.append(f'<p class="headline">{_e(result.headline)}</p>')
    model = result.meta.get("model")
    said = [f"model {_e(model.get('label', model.get('name', '')))}"] if isinstance(
        model, dict) else []
    said += [f"measured {_e(result.meta['date'])}"] if "date" in result.meta else []
    if said:
        parts.append(f'<p class="note">{" · ".join(said)}</p>')
    if files:
        parts.append('<p class="note">files: ' + " · ".join(
            f'<a href="{_e(name)}">{_e(label)}</a>' for label, name in files.items()) + "</p>")
    if result.command == "attention" and len(result.table):
        patterns = attention_data(result.table)
        options = "".join(f'<option value="{k}">layer {k.split(".")[0]}, head '
                          f'{k.split(".")[1]}</option>' for k in patterns)
        parts.append(f'<p><label>head <select id="heads">{options}</select></label> '
                     '<span class="note">point at a cell: the weight a query (row) gives a '
                     'key (column)</span></p>')
        parts.append(_json_script("attention-data", patterns))
    if failed:
        parts.append(f'<p class="headline">The charts could not be drawn ({_e(failed)}); '
                     "the tables below are the run's.</p>")
    parts += [f'<div id="chart-{k}" class="chart"></div>' for k in range(len(figures))]
    for name, df in result.tables.items():
        heading = "The table" if name == "main" else f"The {name} table"
        parts.append(f"<h2>{_e(heading)}</h2>" + table(df, f"table-{name}"))
    parts.append("<h2>Settings</h2>" + settings(result.meta))
    body = "\n".join(parts)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{_e(title)}</title><style>{STYLE}</style>"
            f'<script src="{SCRIPT}"></script></head>\n<body>\n{body}\n'
            f'{_json_script("figures", figures)}\n<script>{CODE}</script>\n</body></html>\n')


def table(df: pd.DataFrame, ident: str) -> str:
    """A sortable table of `df`'s first MAX_ROWS rows, each cell as the CSV writes it
    (numbers to 6 significant digits on screen, the full value in `data-value`)."""
    shown = df.head(MAX_ROWS)
    kinds = ["number" if pd.api.types.is_numeric_dtype(df[c]) and
             not pd.api.types.is_bool_dtype(df[c]) else "text" for c in df.columns]
    head = "".join(f'<th data-kind="{k}" class="{k}">{_e(c)}</th>'
                   for c, k in zip(df.columns, kinds, strict=True))
    rows = []
    for values in shown.itertuples(index=False):
        cells = []
        for v, k in zip(values, kinds, strict=True):
            if k == "number":
                full = "" if _missing(v) else repr(float(v)) if isinstance(v, float) else str(v)
                text = "" if _missing(v) else f"{v:.6g}" if isinstance(v, float) else str(v)
                cells.append(f'<td data-value="{full}">{text}</td>')
            else:
                cells.append(f'<td class="text">{"" if _missing(v) else _e(str(v))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    note = (f'<p class="note">the first {MAX_ROWS:,} of {len(df):,} rows; the CSV has them '
            "all</p>" if len(df) > MAX_ROWS else "")
    return (f'<div class="wide"><table class="data" id="{_e(ident)}"><thead><tr>{head}</tr>'
            "</thead><tbody>" + "".join(rows) + f"</tbody></table></div>{note}")


def settings(meta: dict) -> str:
    """Every field of the sidecar: a row each, nested values as JSON."""
    rows = []
    for key, value in meta.items():
        if isinstance(value, (dict, list)):
            shown = f"<pre>{_e(json.dumps(value, indent=1, default=str))}</pre>"
        else:
            shown = _e(str(value))
        rows.append(f"<tr><td><b>{_e(key)}</b></td><td>{shown}</td></tr>")
    return f'<table class="settings">{"".join(rows)}</table>'


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, numbers.Real) and math.isnan(v))


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _dumps(data) -> str:
    """JSON for a script element: standard JSON, "</" escaped so no string ends it."""
    return json.dumps(data, allow_nan=False, default=str).replace("</", "<\\/")


def _json_script(ident: str, data) -> str:
    return f'<script type="application/json" id="{ident}">{_dumps(data)}</script>'


def ensure_script(out_dir) -> list:
    """Copy plotly.js into `out_dir` as SCRIPT unless it is there already (temp file, then
    rename): [its path] when written, [] when it was there."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    source, target = _script_path(), Path(out_dir) / SCRIPT
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return []
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{SCRIPT}.", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return [target]


_INLINED = False  # whether this process has put plotly.js into a notebook already


def notebook(result) -> str:
    """The charts for a notebook's output: plotly.js inlined with the first (as plotly's
    offline notebook mode does: no network), each chart its own div."""
    global _INLINED
    from blockscope.results.charts import charts

    figures = charts(result)
    if not figures:
        return ""
    out = [] if _INLINED else [f"<script>{script()}</script>"]
    _INLINED = True
    for fig in figures:
        ident = f"blockscope-{uuid.uuid4().hex[:12]}"
        out.append(f'<div id="{ident}"></div><script>Plotly.newPlot("{ident}", '
                   f'{_dumps(fig["data"])}, {_dumps(fig["layout"])}, '
                   '{"displaylogo": false, "responsive": true});</script>')
    return "".join(out)


def _script_path():
    from importlib import resources

    return resources.files("plotly") / "package_data" / "plotly.min.js"


def script() -> str:
    """plotly.js, as the plotly package ships it (what every page loads)."""
    return _script_path().read_text(encoding="utf-8")


__all__ = ["MAX_ROWS", "SCRIPT", "ensure_script", "notebook", "page", "script", "settings",
           "table"]
