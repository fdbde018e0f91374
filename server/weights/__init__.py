"""Weight sync: baselines' initial parameters, held and converted for candidates (docs/weight-sync.md)."""
