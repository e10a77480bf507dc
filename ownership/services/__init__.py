"""Ownership services by sub-domain: conflicts (opening), resolution, catalog."""
