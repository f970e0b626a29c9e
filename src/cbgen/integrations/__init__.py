"""Adapters to frameworks that drive generation themselves (TRL).  Each imports its framework lazily."""
