"""The saved runs of ``perfsleuth startup`` and ``perfsleuth load`` (``<data>/runs/``):
``GET /api/startup`` (the runs, newest first), ``GET /api/startup/{name}`` (one report, with
``?compare=OTHER`` the before/after per phase against another), ``GET /api/load`` and
``GET /api/load/{name}``.

An :class:`fastapi.APIRouter` that :func:`perfsleuth.server.app.create_app` includes; the data
directory comes from the app's backend (``app.state.backend``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from perfsleuth.analysis import load as ld
from perfsleuth.analysis import startup as st

router = APIRouter()


def _data(request: Request) -> str:
    return str(request.app.state.backend.data_dir)


def _missing(what: str, name: str) -> JSONResponse:
    return JSONResponse({"error": f"no {what} run named {name!r}", "status": 404}, 404)


@router.get("/api/startup", summary="Saved start-up runs, newest first")
def startup_runs(request: Request) -> list[dict[str, Any]]:
    return [
        {
            "name": r["name"],
            "total_ms": r["report"].get("total_ms"),
            "command": r["report"].get("command"),
            "url": r["report"].get("url"),
        }
        for r in st.list_runs(_data(request))
    ]


@router.get("/api/startup/{name}", summary="One start-up run (optionally against another)")
def startup_run(
    request: Request,
    name: str,
    compare: Annotated[str | None, Query(description="Another run: the change per phase.")] = None,
) -> Any:
    report = st.read_run(_data(request), name)
    if report is None:
        return _missing("start-up", name)
    if compare:
        before = st.read_run(_data(request), compare)
        if before is None:
            return _missing("start-up", compare)
        report["compare"] = st.compare(before, report)
        report["compare"]["before"] = compare
    return report


@router.get("/api/load", summary="Saved load runs, newest first")
def load_runs(request: Request) -> list[dict[str, Any]]:
    return [
        {
            "name": r["name"],
            "run_id": r["report"].get("run_id"),
            "verdict": r["report"].get("verdict"),
            "targets": {k: v.get("target") for k, v in (r["report"].get("sides") or {}).items()},
            "achieved_rate": r["report"].get("achieved_rate"),
        }
        for r in st.list_runs(_data(request), ld.RUNS_DIR)
    ]


@router.get("/api/load/{name}", summary="One load run with its per-endpoint verdict")
def load_run(request: Request, name: str) -> Any:
    report = st.read_run(_data(request), name, ld.RUNS_DIR)
    return _missing("load", name) if report is None else report
