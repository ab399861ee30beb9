"""Command lines over the library: plan_schedule.py and check_schedule.py (tools/)."""
