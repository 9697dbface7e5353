"""Shared pytest fixtures: real servers started for the session and stopped after."""
