"""Hostile input against the engines' routes: malformed bodies, foreign handles, requests out of order."""
