"""Process groups and ranks 1..k-1 of a split model (local or Ray); imports no models, kv or engine."""
