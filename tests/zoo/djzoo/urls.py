from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import path

from zoo import django_chatty, django_n1_orm, django_slow_query


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [
    path("health/", health),
    path("n1-orm/bad/", django_n1_orm.authors_bad),
    path("n1-orm/clean/", django_n1_orm.authors_clean),
    path("slow-query/bad/", django_slow_query.revenue_bad),
    path("slow-query/clean/", django_slow_query.revenue_clean),
    path("chatty/bad/", django_chatty.dashboard_bad),
    path("chatty/clean/", django_chatty.dashboard_clean),
]
