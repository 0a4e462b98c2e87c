"""sparrow: an inference engine for Mixture-of-Experts LLMs with quantized weights.

    from sparrow import LLM, SamplingParams
    llm = LLM()                                   # packaged Gemma 3 270M, or LLM("path/to/model")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(out[0].outputs[0].text)
"""
from sparrow.errors import SparrowError
from sparrow.lora.request import LoRARequest
from sparrow.outputs import CompletionOutput, Logprob, RequestOutput
from sparrow.sampling_params import SamplingParams
from sparrow.structured_outputs import StructuredOutputsParams


def __getattr__(name):  # LLM pulls in torch models; import it lazily so `import sparrow` stays cheap
    if name == "LLM":
        from sparrow.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob", "SparrowError"]
__version__ = "0.1.0"
