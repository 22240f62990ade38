"""Training drafters for a target: self-distilled data, target features, EAGLE-3 TTT."""
