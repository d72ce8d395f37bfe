"""Authors and books for django_n1_orm (tables created by zoo.seed, hence unmanaged)."""

from __future__ import annotations

from django.db import models


class Author(models.Model):
    name = models.TextField()

    class Meta:
        managed = False
        db_table = "author"


class Book(models.Model):
    author = models.ForeignKey(Author, on_delete=models.CASCADE)
    title = models.TextField()
    pages = models.IntegerField()

    class Meta:
        managed = False
        db_table = "book"
