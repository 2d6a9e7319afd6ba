"""Sweeps: a search space on Ray Tune, and what a sweep may spend."""
