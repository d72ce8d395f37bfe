from __future__ import annotations

import os

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

import perfsleuth.agent as ps


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def order(request: HttpRequest, order_id: int) -> JsonResponse:
    ps.attr("order_id", order_id)
    ps.attr("pid", os.getpid())
    return JsonResponse({"order_id": order_id, "pid": os.getpid()})


async def async_order(request: HttpRequest, order_id: int) -> JsonResponse:
    return JsonResponse({"order_id": order_id, "async": True})


def invoice(request: HttpRequest, year: str, number: str) -> HttpResponse:
    return HttpResponse(f"invoice {year}/{number}")


def boom(request: HttpRequest) -> HttpResponse:
    raise KeyError("boom")


def stream(request: HttpRequest) -> StreamingHttpResponse:
    return StreamingHttpResponse(iter([b"x" * 10, b"y" * 10]))
