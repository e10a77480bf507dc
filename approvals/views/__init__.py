"""Approvals pages, one module per sub-domain: inbox, runs (and actions), tokens, rules."""
