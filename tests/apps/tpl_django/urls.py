from django.urls import path
from tpl_django import views

urlpatterns = [path("checks/", views.checks), path("plain/", views.plain)]
