"""Create the tables and rows: ``python -m tpl_django.seed`` (TPL_DJANGO_DB names the file)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tpl_django.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from tpl_django.models import Check, Link, Owner  # noqa: E402

call_command("migrate", run_syncdb=True, verbosity=0)
for i in range(1, 6):
    owner = Owner.objects.create(name=f"owner {i}")
    check = Check.objects.create(name=f"check {i}", owner=owner)
    Link.objects.create(check_ref=check, url=f"https://example.test/{i}")
