"""Pure arithmetic about layouts: rules, batch and LR math, estimates. Never imports torch."""
