from django.urls import include, path, re_path
from djproject import views

api = [
    path("orders/<int:order_id>/", views.order),
    path("async-orders/<int:order_id>/", views.async_order),
    re_path(r"^invoices/(?P<year>[0-9]{4})/(?P<number>[0-9]+)/$", views.invoice),
]

urlpatterns = [
    path("health/", views.health),
    path("orders/<int:order_id>/", views.order),
    path("api/", include(api)),
    path("boom/", views.boom),
    path("stream/", views.stream),
]
