"""The per-call inputs: checked once before any kernel runs and gathered in a LossBatch
(checks.py), with which rows form which sequence (segments.py). Stage 1 (token_stats/,
linear/) and stage 2 (sequence/) both read them; this folder imports only config, backends
and distributed."""
