#!/usr/bin/env python
"""Validate a schedule CSV (as written by plan_schedule.py --save-schedule)."""

import sys

from megatron_mllm.cli.plan_schedule import check_schedule_main

if __name__ == "__main__":
    sys.exit(check_schedule_main())
