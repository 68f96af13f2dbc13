"""The index of a results folder (`blockscope report`): one row per run, read from the
sidecars (`<stem>-<digest>.json`) under the folder, with a link to each run's page, and
filters by command and model. The lab notebook a researcher keeps by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from blockscope.results.page import SORT, STYLE, _e

NAME = "index.html"
CODE = """
const rows=[...document.querySelectorAll('#runs tbody tr')];
const pick=[...document.querySelectorAll('select.filter')];
function filter(){for(const r of rows){r.hidden=!pick.every(
  s=>s.value===''||r.dataset[s.dataset.key]===s.value);}
  document.getElementById('shown').textContent=rows.filter(r=>!r.hidden).length;}
for(const s of pick)s.addEventListener('change',filter);
filter();
""" + SORT  # the page's sorting: every column here is text


def runs(folder: Path) -> pd.DataFrame:
    """One row per run whose sidecar lies under `folder`: command, model, date, headline,
    the page (relative path, empty where the run wrote none) and the sidecar, newest
    first."""
    rows = []
    for path in sorted(folder.rglob("*.json")):
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue  # .partial and other hidden folders
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not a sidecar
        if not isinstance(meta, dict) or "command" not in meta or "settings_digest" not in meta:
            continue
        model = meta.get("model")
        if isinstance(model, dict):
            model = model.get("label") or model.get("name")
        headline = meta.get("summary") or meta.get("headline")
        page = path.with_suffix(".html")
        rows.append({"command": str(meta["command"]), "model": str(model or ""),
                     "date": str(meta.get("date", ""))[:16].replace("T", " "),
                     "headline": headline if isinstance(headline, str) else "",
                     "page": page.relative_to(folder).as_posix() if page.is_file() else "",
                     "sidecar": path.relative_to(folder).as_posix()})
    df = pd.DataFrame(rows, columns=["command", "model", "date", "headline", "page",
                                     "sidecar"])
    return df.sort_values("date", ascending=False, kind="stable").reset_index(drop=True)


def index(df: pd.DataFrame, title: str) -> str:
    """The index page of `runs`' table."""
    def options(key: str) -> str:
        values = sorted(v for v in df[key].unique() if v)
        return (f'<label>{key} <select class="filter" data-key="{key}"><option value="">'
                f'all</option>' + "".join(f'<option value="{_e(v)}">{_e(v)}</option>'
                                          for v in values) + "</select></label>")

    body = []
    for r in df.itertuples(index=False):
        link = (f'<a href="{_e(r.page)}">page</a>' if r.page else "")
        body.append(f'<tr data-command="{_e(r.command)}" data-model="{_e(r.model)}">'
                    f'<td class="text">{_e(r.command)}</td><td class="text">{_e(r.model)}</td>'
                    f'<td class="text">{_e(r.date)}</td><td class="text">{_e(r.headline)}</td>'
                    f'<td class="text">{link} <a href="{_e(r.sidecar)}">sidecar</a></td></tr>')
    head = "".join(f'<th class="text">{h}</th>' for h in
                   ("command", "model", "date", "headline", "files"))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f'{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n<h1>{_e(title)}</h1>'
            f'<p>{options("command")} {options("model")} <span class="note"><span id="shown">'
            f'{len(df)}</span> of {len(df)} runs shown</span></p>'
            f'<div class="wide"><table id="runs" class="data"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>\n<script>{CODE}</script>\n'
            "</body></html>\n")


__all__ = ["NAME", "index", "runs"]
