"""The pages: ``n1`` lists AUTHORS authors and each one's books through the reverse relation
(1 + AUTHORS statements), ``clean`` the same with prefetch_related (2 statements), ``raw`` runs
one statement on Django's cursor."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from djversions.models import Author

AUTHORS = 60


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def n1(request: HttpRequest) -> JsonResponse:
    out = []
    for author in Author.objects.order_by("id")[:AUTHORS]:
        titles = [b.title for b in author.book_set.all()]  # N+1: one statement per author
        out.append({"name": author.name, "books": titles})
    return JsonResponse({"authors": out})


def clean(request: HttpRequest) -> JsonResponse:
    page = Author.objects.order_by("id").prefetch_related("book_set")[:AUTHORS]
    out = [{"name": a.name, "books": [b.title for b in a.book_set.all()]} for a in page]
    return JsonResponse({"authors": out})


def raw(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM djv_book WHERE author_id <= %s", [10])
        (n,) = cur.fetchone()
    return JsonResponse({"books": n})
