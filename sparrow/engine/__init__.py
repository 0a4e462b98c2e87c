"""The engine in four parts: facade (engine.py), scheduler, block manager, model runner; the step's contract
(step_plan.py) and speculative decoding's interface (speculator.py). ``LLM`` (``sparrow.llm``) builds it."""
