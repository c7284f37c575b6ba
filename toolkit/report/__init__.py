"""Sweeps and what runs leave behind: measured rows beside the planner's predictions."""
