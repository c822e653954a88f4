"""Example tools and graphs used by ``manifests/examples`` and the tests."""
