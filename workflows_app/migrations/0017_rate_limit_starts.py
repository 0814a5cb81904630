"""rate_limit counts its own log of starts (RateLimitStart), not the instance rows.

Counting instances whose started_at fell in the window lost starts: a deleted or pruned
instance took its start with it, and a restart set started_at anew over the earlier one,
so more than `limit` instances started in a period. The log is written by admission for
workflows with a rate_limit only, and the instance index the count read
(`instance_started`) is dropped: no other query reads it, and every start wrote an entry
into it.

Nothing is copied into the log: the starts of a window open at the upgrade are not in it,
so once, for up to one period, up to `limit` more may start.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0016_token_issuer"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateLimitStart",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("workflow", models.CharField(max_length=200)),
                ("started_at", models.DateTimeField()),
            ],
            options={
                "indexes": [
                    models.Index(fields=["workflow", "started_at"], name="rate_limit_start")
                ],
            },
        ),
        migrations.RemoveIndex(model_name="instance", name="instance_started"),
    ]
