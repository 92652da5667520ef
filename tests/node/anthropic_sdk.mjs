// The Anthropic Node SDK against a trillm server: messages.create, then messages.stream.
// Usage: node anthropic_sdk.mjs BASE_URL MODEL, with @anthropic-ai/sdk in a node_modules beside it.
// Prints one JSON line with what the SDK returned, for the Python test to judge.
import Anthropic from '@anthropic-ai/sdk';

const [baseURL, model] = process.argv.slice(2);
const client = new Anthropic({ baseURL, apiKey: 'none', maxRetries: 0 });
const body = {
  model,
  max_tokens: 12,
  system: 'Answer briefly.',
  messages: [{ role: 'user', content: 'Name three colors.' }],
  temperature: 0, // older clients' field; the SDK sends the body as given
};
const created = await client.messages.create(body);
let streamed = '';
const stream = client.messages.stream(body);
stream.on('text', (text) => { streamed += text; });
const final = await stream.finalMessage();
console.log(JSON.stringify({ created, streamed, final }));
