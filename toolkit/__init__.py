"""parakit: compose, validate, plan and emit parallel training layouts."""
