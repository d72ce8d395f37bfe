"""The saved runs of ``perfsleuth startup`` and ``perfsleuth load`` (``<data>/runs/``):
``GET /api/startup`` (the runs, newest first), ``GET /api/startup/{name}`` (one report, with
``?compare=OTHER`` the before/after per phase against another), ``GET /api/load`` and
``GET /api/load/{name}``. They read files, not the store."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from perfsleuth.analysis import load as ld
from perfsleuth.analysis import startup as st
from perfsleuth.server import models
from perfsleuth.server.deps import BackendDep, error, ok

router = APIRouter()


@router.get(
    "/api/startup",
    summary="Saved start-up runs, newest first",
    response_model=list[models.StartupRunBrief],
)
def startup_runs(be: BackendDep) -> Response:
    return ok(
        [
            {
                "name": r["name"],
                "total_ms": r["report"].get("total_ms"),
                "command": r["report"].get("command"),
                "url": r["report"].get("url"),
            }
            for r in st.list_runs(be.data_dir)
        ]
    )


@router.get(
    "/api/startup/{name}",
    summary="One start-up run (optionally against another)",
    response_model=dict[str, Any],
)
def startup_run(
    be: BackendDep,
    name: str,
    compare: Annotated[str | None, Query(description="Another run: the change per phase.")] = None,
) -> Any:
    report = st.read_run(be.data_dir, name)
    if report is None:
        return error(404, f"no start-up run named {name!r}")
    if compare:
        before = st.read_run(be.data_dir, compare)
        if before is None:
            return error(404, f"no start-up run named {compare!r}")
        report["compare"] = st.compare(before, report)
        report["compare"]["before"] = compare
    return report


@router.get(
    "/api/load",
    summary="Saved load runs, newest first",
    response_model=list[models.LoadRunBrief],
)
def load_runs(be: BackendDep) -> Response:
    return ok(
        [
            {
                "name": r["name"],
                "run_id": r["report"].get("run_id"),
                "verdict": r["report"].get("verdict"),
                "targets": {
                    k: v.get("target") for k, v in (r["report"].get("sides") or {}).items()
                },
                "achieved_rate": r["report"].get("achieved_rate"),
            }
            for r in st.list_runs(be.data_dir, ld.RUNS_DIR)
        ]
    )


@router.get(
    "/api/load/{name}",
    summary="One load run with its per-endpoint verdict",
    response_model=dict[str, Any],
)
def load_run(be: BackendDep, name: str) -> Any:
    report = st.read_run(be.data_dir, name, ld.RUNS_DIR)
    return error(404, f"no load run named {name!r}") if report is None else report
