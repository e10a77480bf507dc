# Approve a plan step with edits (issue 42 §1): a plan can be superseded by its edit.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('approvals', '0013_grants'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='plan',
            name='edit',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='plan',
            name='edited_by',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='plan',
            name='superseded_by',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='supersedes', to='approvals.plan'),
        ),
        migrations.AlterField(
            model_name='plan',
            name='status',
            field=models.CharField(choices=[('pending_approval', 'pending approval'), ('executing', 'executing'), ('compensating', 'compensating'), ('applied', 'applied'), ('compensated', 'compensated'), ('partially_compensated', 'partially compensated'), ('rejected', 'rejected'), ('expired', 'expired'), ('cancelled', 'cancelled'), ('superseded', 'superseded')], max_length=24),
        ),
    ]
