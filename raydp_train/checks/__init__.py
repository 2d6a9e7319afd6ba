"""Checks on bad input before any budget is reserved, and what validate reports."""
