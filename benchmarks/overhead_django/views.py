from typing import Any

from django.http import HttpRequest, JsonResponse

from overhead_django.models import Order


def get_order(request: HttpRequest, order_id: int) -> JsonResponse:
    order = Order.objects.select_related("customer").get(id=order_id)
    items: list[dict[str, Any]] = []
    for item in order.items.order_by("line"):  # the N+1: item.product is a query each
        items.append({"product": item.product.name, "qty": item.qty, "price": item.product.price})
    total = sum(i["price"] * i["qty"] for i in items)
    return JsonResponse(
        {
            "id": order.id,
            "placed": order.placed,
            "customer": order.customer.name,
            "items": items,
            "total": total,
        }
    )
