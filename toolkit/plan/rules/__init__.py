"""The validator's rules, by theme (toolkit.plan.validate runs them all)."""
