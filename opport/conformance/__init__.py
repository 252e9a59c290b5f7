"""The conformance suite: cases from the op declarations, compared with the float64 reference."""
