// Ollama's JavaScript client against a trillm server: list, show, chat whole and streamed,
// generate, embed, and an unknown model's error.
// Usage: node ollama_client.mjs BASE_URL MODEL, with `ollama` in a node_modules beside it.
// Prints one JSON line with what the client returned, for the Python test to judge.
import { Ollama } from 'ollama';

const [host, model] = process.argv.slice(2);
const ollama = new Ollama({ host });
const messages = [{ role: 'user', content: 'Name three colors.' }];
const options = { temperature: 0, num_predict: 12 };

const listed = await ollama.list();
const shown = await ollama.show({ model });
const chat = await ollama.chat({ model, messages, options });
let streamed = '';
let last = null;
for await (const part of await ollama.chat({ model, messages, options, stream: true })) {
  streamed += part.message.content;
  last = part;
}
const generated = await ollama.generate({ model, prompt: 'Name three colors.', options });
const embedded = await ollama.embed({ model, input: ['red', 'green'] });
let missing = null;
try {
  await ollama.chat({ model: 'no-such-model', messages });
} catch (error) {
  missing = { name: error.name, status: error.status_code, message: error.message };
}
console.log(JSON.stringify({
  listed, details: shown.details, chat, streamed, last, generated,
  embedded: embedded.embeddings.map((e) => e.length), missing,
}));
