"""Django project whose per-row queries run from a template (issue 15 item 4): a model FK
loaded by ``{{ check.owner.name }}`` (Django's ORM code issues it) and a model property
``{{ check.link_count }}`` used on two template lines (the same Python line issues both)."""
