"""What a run, a sweep and a budget report: records, tables, plots."""
