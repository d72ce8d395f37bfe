from django.urls import path

from overhead_django.views import get_order

urlpatterns = [path("orders/<int:order_id>", get_order)]
