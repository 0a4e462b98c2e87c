"""The engine in four parts: facade (engine.py / llm.py), scheduler, block manager, model runner."""
