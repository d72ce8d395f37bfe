"""Authors and books (tables created by the test, hence unmanaged)."""

from __future__ import annotations

from django.db import models


class Author(models.Model):
    name = models.TextField()

    class Meta:
        app_label = "djversions"
        managed = False
        db_table = "djv_author"


class Book(models.Model):
    author = models.ForeignKey(Author, on_delete=models.CASCADE)
    title = models.TextField()

    class Meta:
        app_label = "djversions"
        managed = False
        db_table = "djv_book"
