"""Integrations with training frameworks: each submodule imports its framework, so import it only where it is
installed (``elastic.integrations.torchtitan`` needs torchtitan)."""
