from django.urls import path
from djversions import views

urlpatterns = [
    path("health/", views.health),
    path("n1/", views.n1),
    path("clean/", views.clean),
    path("raw/", views.raw),
]
