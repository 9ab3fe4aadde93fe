LONGEST = ("test_fsdp.py", "test_bad_input.py")


def pytest_collection_modifyitems(items):
    """the two longest files first, one on each worker (pytest.ini), so that both workers end together"""
    items.sort(key=lambda item: LONGEST.index(item.path.name) if item.path.name in LONGEST else len(LONGEST))
