"""Request bodies, as pydantic models, one module per API family, and their translation into
SamplingParams (or PoolingParams).

common       the strict base, bounds on lists, prompts, stream options, template options
sampling     the sampling knobs, declared once and translated once; OpenAI's shared fields
structured   response_format and structured_outputs, as one StructuredOutput spec
chat         /v1/chat/completions          completions  /v1/completions
responses    /v1/responses (a chat request in other words)
embeddings   /v1/embeddings, /pooling, /score, /rerank
native       /generate (SGLang's and LMDeploy's), /abort_request, /tokenize, /detokenize
admin        LoRA adapters, weight updates
"""
