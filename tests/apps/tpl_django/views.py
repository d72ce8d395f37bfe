from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from tpl_django.models import Check


def checks(request: HttpRequest) -> HttpResponse:
    return render(request, "checks.html", {"checks": Check.objects.order_by("id")})


def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse(str(Check.objects.count()))
