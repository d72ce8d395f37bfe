from django.db import models


class Owner(models.Model):
    name = models.CharField(max_length=50)


class Check(models.Model):
    name = models.CharField(max_length=50)
    owner = models.ForeignKey(Owner, on_delete=models.CASCADE)

    @property
    def link_count(self) -> int:
        return Link.objects.filter(check_ref=self).count()


class Link(models.Model):
    check_ref = models.ForeignKey(Check, on_delete=models.CASCADE)
    url = models.CharField(max_length=200)
