"""n_plus_one through the Django ORM: the authors page lists each author's books through the
reverse relation, one query per author. Clean twin: prefetch_related (two queries)."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from zoo.djzoo.models import Author

AUTHORS_PER_PAGE = 30


def authors_bad(request: HttpRequest) -> JsonResponse:
    authors = []
    for author in Author.objects.order_by("id")[:AUTHORS_PER_PAGE]:
        titles = [book.title for book in author.book_set.all()]  # PLANTED: n_plus_one
        authors.append({"name": author.name, "books": titles})
    return JsonResponse({"authors": authors})


def authors_clean(request: HttpRequest) -> JsonResponse:
    page = Author.objects.order_by("id").prefetch_related("book_set")[:AUTHORS_PER_PAGE]
    authors = [{"name": a.name, "books": [b.title for b in a.book_set.all()]} for a in page]
    return JsonResponse({"authors": authors})
