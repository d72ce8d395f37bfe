"""The shop's tables (created and seeded by overhead.py, not by migrations)."""

from django.db import models


class Customer(models.Model):
    name = models.TextField()

    class Meta:
        managed = False
        db_table = "bench_overhead_customers"


class Product(models.Model):
    name = models.TextField()
    price = models.FloatField()

    class Meta:
        managed = False
        db_table = "bench_overhead_products"


class Order(models.Model):
    customer = models.ForeignKey(Customer, on_delete=models.DO_NOTHING)
    placed = models.TextField()

    class Meta:
        managed = False
        db_table = "bench_overhead_orders"


class OrderItem(models.Model):
    order = models.ForeignKey(Order, on_delete=models.DO_NOTHING, related_name="items")
    line = models.IntegerField()
    product = models.ForeignKey(Product, on_delete=models.DO_NOTHING)
    qty = models.IntegerField()

    class Meta:
        managed = False
        db_table = "bench_overhead_order_items"
