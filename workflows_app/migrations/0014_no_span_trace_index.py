"""Spans: no index on the trace id.

Every span row entered `span_trace` (trace_id, start_time). Trace ids are random, so each
entry went to a random page of an index as large as the table: on SQLite a row's insert
took 9.4-11.5 µs against 5.0-5.8 without it on an empty table, and 17.6-18.7 against
4.6-7.1 with 300,000 spans stored (docs/performance.md, fourteenth round). Nothing read
spans by trace id but the deletion of an instance's spans stored before its row was known
(instance_id NULL, a few): span_instance finds those at its NULL end. The dashboard reads
an instance's spans through span_instance too.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("workflows_app", "0013_instance_fillfactor"),
    ]

    operations = [migrations.RemoveIndex(model_name="span", name="span_trace")]
