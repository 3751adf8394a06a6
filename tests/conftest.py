from engine_fixture import engine  # noqa: F401  (a real engine process per test module)
