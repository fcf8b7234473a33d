"""What users call: the stepper, run and evaluate."""
